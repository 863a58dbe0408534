"""``splitproof export``: a saved LoRA adapter merged into its base model, written as a Hugging Face
directory (W + s·B·A; log-probs equal to the adapter model's), with the tokenizer of the adapter directory
(else of the base model) beside it. Bad input is one line, exit 2, before
any model is loaded where it can be."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .arguments import EXIT_PASS, UsageError, quiet_loading

DTYPES = ("float32", "float64", "bfloat16")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="merge a saved LoRA adapter into its base model (a Hugging Face directory)",
        description=__doc__.split("\n\n")[0].replace("``", "'"),
    )
    p.add_argument(
        "adapter",
        metavar="ADAPTER",
        help="the adapter directory (adapter_config.json + adapter_model.safetensors, PEFT's format)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="where the merged model is written (new or empty)")
    p.add_argument("--model", metavar="PATH", help="the base model (default: the adapter's base_model_name_or_path)")
    p.add_argument("--dtype", choices=DTYPES, help="load the base model in this dtype (default: as saved)")
    p.set_defaults(run=run)


def run(args) -> int:
    import torch

    from splitproof.lora import merge_adapter, read_adapter_config
    from splitproof.loss_config import ConfigError

    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        with quiet_loading():
            path = merge_adapter(args.adapter, args.out, model_path=args.model, dtype=dtype)
        base = args.model or read_adapter_config(args.adapter, None).get("base_model_name_or_path")
    except (ConfigError, ImportError, FileNotFoundError) as exc:
        raise UsageError(str(exc)) from None
    source = copy_tokenizer([args.adapter, base], path)
    if source is None:
        print(
            f"splitproof: notice: neither {args.adapter} nor {base} holds a tokenizer; {path} has none", file=sys.stderr
        )
    print(f"wrote {path}" + (f" (tokenizer from {source})" if source else ""))
    return EXIT_PASS


def copy_tokenizer(sources: list, out: str | os.PathLike) -> str | None:
    """Save into ``out`` the tokenizer of the first of ``sources`` that holds one; that source, or None."""
    from transformers import AutoTokenizer

    for source in sources:
        if source and (Path(source) / "tokenizer_config.json").is_file():
            AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(out)
            return str(source)
    return None
