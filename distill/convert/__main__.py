"""Convert checkpoints between Hugging Face and this project.

    python -m distill.convert --from hf --hf-dir DIR --to mcore --out CKPT \\
        [--tensor-model-parallel-size N] [--expert-model-parallel-size N] \\
        [--pipeline-model-parallel-size N] [--allow-pickle]
    python -m distill.convert --from mcore --load CKPT --to hf --out DIR [--family NAME]

Families: Qwen3-MoE (``qwen3_moe``), DeepSeek-V2 / V2-Lite (``deepseek_v2``), Mixtral (``mixtral``);
see docs/guides/convert.md. Runs in one process on the CPU. Bad input exits 2 with one ``error:`` line and
writes nothing.
"""

from __future__ import annotations

import sys

from megatron.components.arguments import OneLineParser

__all__ = ["main", "build_parser"]


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="python -m distill.convert", allow_abbrev=False,
                      description="Hugging Face <-> this project checkpoint conversion")
    p.add_argument("--from", dest="source", required=True, choices=["hf", "mcore"])
    p.add_argument("--to", dest="target", required=True, choices=["hf", "mcore"])
    p.add_argument("--out", required=True, help="output directory (must not exist)")
    p.add_argument("--hf-dir", help="Hugging Face model directory (--from hf)")
    p.add_argument("--load", help="our checkpoint directory (--from mcore)")
    p.add_argument("--family", help="Hugging Face model_type to export as (default: the one imported from)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--allow-pickle", action="store_true",
                   help="read pytorch_model*.bin (with torch.load(weights_only=True)) when no safetensors exist")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if {args.source, args.target} != {"hf", "mcore"}:
        parser.error(f"--from {args.source} --to {args.target}: convert hf -> mcore or mcore -> hf")
    import warnings

    from megatron import compat

    compat.quiet_warnings()
    # upstream deprecation notices on the dist_checkpointing load path a user cannot act on
    for message in (r"`load_state_dict` is deprecated", r"Please use DTensor instead"):
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    from distill.convert.hf_mcore import export_hf, import_hf
    from megatron.components.checkpointing import CheckpointError
    from megatron.common.cli import UserError, run_cli

    def body():
        if args.source == "hf":
            if not args.hf_dir:
                parser.error("--from hf needs --hf-dir")
            out = import_hf(args.hf_dir, args.out, tensor_parallel=args.tensor_model_parallel_size,
                            expert_parallel=args.expert_model_parallel_size,
                            pipeline_parallel=args.pipeline_model_parallel_size, allow_pickle=args.allow_pickle)
        else:
            if not args.load:
                parser.error("--from mcore needs --load")
            out = export_hf(args.load, args.out, family_name=args.family)
        print(f"wrote {out}", flush=True)

    return run_cli(parser.prog, body, user_errors=(UserError, CheckpointError))


if __name__ == "__main__":
    sys.exit(main())
