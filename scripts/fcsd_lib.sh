# Shared steps of the FCSD demonstration scripts (scripts/fcsd_demo.sh, scripts/fcsd_ablations.sh).
# Source it after setting PYTHON, TORCHRUN and NPROC. Every step is skipped when its output exists,
# so an interrupted script resumes; DRY_RUN=1 prints the commands instead of running them.

BPE=data/pretrain/bpe8192

run() {  # run CMD...: execute, or print it (shell-quoted) under DRY_RUN
    if [[ -n ${DRY_RUN:-} ]]; then
        printf '%q ' "$@"
        echo
    else
        "$@"
    fi
}

finished() {  # finished <run dir>: its metrics.jsonl has a summary event of a run that was not interrupted
    [[ -f $1/metrics.jsonl ]] && grep '"event": "summary"' "$1/metrics.jsonl" | grep -qv '"interrupted": true'
}

fcsd_check_positive() {  # fcsd_check_positive PROG NAME VALUE: a one-line error unless VALUE is a positive integer
    [[ $3 =~ ^[1-9][0-9]*$ ]] || { echo "$1: error: $2 must be a positive integer, got '$3'" >&2; exit 2; }
}

fcsd_prepare_data() {  # fcsd_prepare_data SHARED: the pretraining corpus and the ShareGPT distillation corpus
    local shared=$1
    run env PYTHON="$PYTHON" TOKENIZERS=bpe scripts/prepare_pretrain_corpus.sh "$shared" data/pretrain
    if [[ ! -f data/sft/sharegpt_text_document.bin ]]; then
        [[ -f data/sft/sharegpt_all.jsonl ]] || run "$PYTHON" scripts/semmoe_prompts.py \
            --data-dir "$shared/prompts" --out-dir data/sft --datasets sharegpt
        run "$PYTHON" scripts/preprocess_data.py --input data/sft/sharegpt_all.jsonl --json-keys text \
            --output-prefix data/sft/sharegpt --tokenizer-type HuggingFaceTokenizer \
            --tokenizer-model "$BPE/tokenizer.json" --append-eod --workers 1
    fi
}

fcsd_teacher() {  # fcsd_teacher DIR [FLAGS...]: pretrain examples/corpus_moe_cpu.yaml (+ FLAGS) into DIR
    # (--save DIR --load DIR: an interrupted teacher resumes; its directory would be refused otherwise)
    local dir=$1
    shift
    finished "$dir" || run "$TORCHRUN" --standalone --nproc_per_node="$NPROC" -m megatron.training.pretrain_gpt \
        --config examples/corpus_moe_cpu.yaml "$@" --save "$dir" --load "$dir"
}

fcsd_data_flags() {  # fcsd_data_flags CORPUS: set the array data_flags for pretrain | sharegpt | mix
    data_flags=()
    case $1 in
    pretrain) ;;  # the checkpoint's own training data
    sharegpt) data_flags=(--data-path data/sft/sharegpt_text_document) ;;
    mix) data_flags=(--data-path 0.5 data/sft/sharegpt_text_document 0.282 "$BPE/warpeace_text_document"
                     0.115 "$BPE/tinyshakespeare_text_document" 0.103 "$BPE/wikitext2_valid_text_document") ;;
    *) return 1 ;;
    esac
}
