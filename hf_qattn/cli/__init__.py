"""``hf-qattn`` command line, one module per subcommand:

    hf-qattn calibrate MODEL_DIR --ratio 0.3 --text FILE --out OUT_DIR                          (calibrate.py)
    hf-qattn calibrate-pipeline PIPELINE_DIR --prompts FILE --steps N --ratio 0.3 --out OUT_DIR  (calibrate_pipeline.py)
    hf-qattn demo [--out DIR] [--model DIR]                                                      (demo.py)
    hf-qattn eval-lm MODEL_DIR --tasks T --modes sdpa,int8,int4,plan --out OUT_DIR                (eval_lm.py)
    hf-qattn eval-attention MODEL_DIR --text FILE --out OUT_DIR                                  (eval_attention.py)
    hf-qattn eval-pipeline PIPELINE_DIR --prompts FILE --modes sdpa,int8,int4,plan --out OUT_DIR  (eval_pipeline.py)

Argument types and :class:`CLIError` are in :mod:`.args`. A subcommand is a function that adds its
parser and sets ``func`` (the function that runs it, taking the parsed arguments and returning an
exit status); list it in :data:`COMMANDS`, or register it with :func:`command`. Keep heavy imports
inside ``func`` so that ``hf-qattn --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib.util  # noqa: F401  (tests reach importlib.util.find_spec through here)
import sys

from .args import CLIError, positive_int, ratio, read_text_lines  # noqa: F401
from .calibrate import _add_calibrate, run_calibrate  # noqa: F401
from .calibrate_pipeline import add_calibrate_pipeline_parser
from .common import format_table, save_plot, score_rows  # noqa: F401
from .demo import DEMO_PACKAGE, DEMO_PIP_NAME, _add_demo, demo_model_dir, run_demo, sample_sentences, sentence_embeddings  # noqa: F401,E501
from .eval_attention import add_eval_attention_parser
from .eval_lm import add_eval_lm_parser
from .eval_pipeline import add_eval_pipeline_parser

__all__ = ["CLIError", "command", "main"]

COMMANDS: list = [_add_calibrate, _add_demo, add_calibrate_pipeline_parser, add_eval_lm_parser,
                  add_eval_attention_parser, add_eval_pipeline_parser]


def command(add_parser):
    """Register a function ``add_parser(subparsers)`` that adds one subcommand."""
    COMMANDS.append(add_parser)
    return add_parser


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line, like every other CLI error (exit status 2, as argparse's)."""

    def error(self, message):
        command = self.prog.removeprefix("hf-qattn").strip()
        where = f"{command}: " if command else ""
        self.exit(2, f"hf-qattn: error: {where}{message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hf-qattn", description="Quantized attention for HuggingFace models.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser in COMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CLIError as error:
        print(f"hf-qattn: error: {error}", file=sys.stderr)
        return 1
