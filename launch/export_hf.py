"""Export a fibjax run as a Hugging Face model directory: ``python -m launch.export_hf --workdir RUN OUT_DIR
[--step S] [--model-type llama|mistral|qwen2] [--dtype float32|bfloat16]``.

Writes config.json, model.safetensors, the run's tokenizer and a README.md into OUT_DIR (new or
empty), loadable by ``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)``. A dense
model computes the same function there (tested); a model trained with Fibonacci offsets or
block-sparse attention exports its weights too, and its README and config.json
(``fibjax_attention``) say that transformers will run them with dense attention instead.
The model type defaults to the imported source's, else llama (qwen2 for q/k/v biases). A run
imported from Hugging Face (or continued from one with ``init_from``) gets the source's side
files back as they came: tokenizer_config.json (chat template, pad and unk tokens, tokenizer
class), special_tokens_map.json, generation_config.json. ``--dtype`` is the stored dtype of
model.safetensors (config.json's ``torch_dtype`` says it).
"""

from __future__ import annotations

import argparse
import json
import sys

from launch._args import Parser


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m launch.export_hf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="the Hugging Face model directory to write (new or empty)")
    parser.add_argument("--workdir", required=True, help="the fibjax run to export")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--model-type", choices=["llama", "mistral", "qwen2"], default=None, help="config.json's model_type")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="stored dtype (default: the run's parameter dtype)")
    args = parser.parse_args(argv)

    from fibjax.errors import FibjaxError
    from fibjax.hf import export_model
    from fibjax.hf.convert import SIDE_FILES

    try:
        out = export_model(args.workdir, args.out_dir, step=args.step, model_type=args.model_type, dtype=args.dtype)
    except FibjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = json.loads((out / "config.json").read_text())
    side = [p.name for p in sorted(out.iterdir()) if p.name in SIDE_FILES]
    attention = config.get("fibjax_attention", {}).get("kind", "dense")
    print(
        f"exported {args.workdir} to {out}: config.json ({config['model_type']}, {attention} attention), model.safetensors ({config['torch_dtype']}), "
        f"the tokenizer{''.join(f', {name}' for name in side)}, README.md"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
