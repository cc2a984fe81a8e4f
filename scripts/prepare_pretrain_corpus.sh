#!/usr/bin/env bash
# Preprocess the shared pretraining corpus into megatron-core indexed datasets (docs/guides/data.md).
#
#   scripts/prepare_pretrain_corpus.sh [SHARED_DATA_DIR] [OUT_DIR]
#
# SHARED_DATA_DIR defaults to ../shared/data, OUT_DIR to data/pretrain. As
# SHARED_DATA_DIR/README.md says: train on War and Peace + tiny-shakespeare + WikiText-2 valid,
# hold out WikiText-2 test. Writes, for two tokenizers,
#   OUT_DIR/bpe8192/tokenizer.json                       a byte-level BPE trained on the 3 files
#   OUT_DIR/bpe8192/{warpeace,tinyshakespeare,wikitext2_valid}_text_document.{bin,idx}
#   OUT_DIR/gpt2/{warpeace,tinyshakespeare,wikitext2_valid}_text_document.{bin,idx}
# Documents are blank-line separated blocks (paragraphs, speeches), each ended by <|endoftext|>.
# Outputs that already exist are kept (delete OUT_DIR to start afresh), so re-running is cheap.
# Environment: VOCAB_SIZE (default 8192), WORKERS (default 2), PYTHON (default: the repository's
# .venv/bin/python when it exists, else python), TOKENIZERS ("bpe gpt2" by default; "bpe" or "gpt2").
set -euo pipefail

SHARED=${1:-../shared/data}
OUT=${2:-data/pretrain}
VOCAB_SIZE=${VOCAB_SIZE:-8192}
WORKERS=${WORKERS:-2}
TOKENIZERS=${TOKENIZERS:-bpe gpt2}
SCRIPTS=$(cd "$(dirname "$0")" && pwd)
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python
    [[ -x $SCRIPTS/../.venv/bin/python ]] && PYTHON=$SCRIPTS/../.venv/bin/python
fi

P=$SHARED/pretrain
NAMES=(warpeace tinyshakespeare wikitext2_valid)
FILES=("$P/war_and_peace/warpeace_input.txt" "$P/tinyshakespeare/input.txt" "$P/wikitext-2/valid.txt")
HELDOUT=$P/wikitext-2/test.txt
GPT2=$SHARED/tokenizers/gpt2

for f in "${FILES[@]}" "$HELDOUT"; do
    [[ -f $f ]] || { echo "prepare_pretrain_corpus.sh: error: missing $f (is $SHARED the shared data directory?)" >&2; exit 2; }
done

if ! "$PYTHON" -c "import megatron.core, tokenizers" 2>/dev/null; then
    echo "prepare_pretrain_corpus.sh: error: $PYTHON cannot import megatron.core and tokenizers; run \`make install\`" \
         "and use .venv/bin/python (or set PYTHON)" >&2
    exit 2
fi

preprocess() {  # preprocess <out_dir> <tokenizer flags...>
    local dir=$1; shift
    mkdir -p "$dir"
    for i in "${!NAMES[@]}"; do
        local prefix=$dir/${NAMES[$i]}
        if [[ -f ${prefix}_text_document.bin && -f ${prefix}_text_document.idx ]]; then
            echo "exists: ${prefix}_text_document"
            continue
        fi
        "$PYTHON" "$SCRIPTS/preprocess_data.py" --input "${FILES[$i]}" --output-prefix "$prefix" \
            --append-eod --workers "$WORKERS" "$@"
    done
}

data_path() {  # the --data-path blend of one output directory (blended by token counts)
    local dir=$1 out=""
    for n in "${NAMES[@]}"; do out+="$dir/${n}_text_document "; done
    echo "${out% }"
}

for tok in $TOKENIZERS; do
    case $tok in
    bpe)
        dir=$OUT/bpe$VOCAB_SIZE
        if [[ -f $dir/tokenizer.json ]]; then
            echo "exists: $dir/tokenizer.json"
        else
            "$PYTHON" "$SCRIPTS/train_tokenizer.py" --input "${FILES[@]}" --vocab-size "$VOCAB_SIZE" \
                --output "$dir/tokenizer.json"
        fi
        preprocess "$dir" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$dir/tokenizer.json"
        echo
        echo "BPE-$VOCAB_SIZE: --tokenizer-type HuggingFaceTokenizer --tokenizer-model $dir/tokenizer.json"
        echo "  --data-path $(data_path "$dir")"
        ;;
    gpt2)
        dir=$OUT/gpt2
        preprocess "$dir" --tokenizer-type GPT2BPETokenizer --vocab-file "$GPT2/encoder.json" \
            --merge-file "$GPT2/vocab.bpe"
        echo
        echo "GPT-2: --tokenizer-type GPT2BPETokenizer --vocab-file $GPT2/encoder.json --merge-file $GPT2/vocab.bpe"
        echo "  --data-path $(data_path "$dir")"
        ;;
    *)
        echo "prepare_pretrain_corpus.sh: error: unknown tokenizer '$tok' in TOKENIZERS (bpe, gpt2)" >&2
        exit 2
        ;;
    esac
done
echo
echo "held-out text (WikiText-2 test, not preprocessed): $HELDOUT"
