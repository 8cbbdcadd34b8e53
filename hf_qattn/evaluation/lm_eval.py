"""``python -m hf_qattn.evaluation.lm_eval ARGS``: lm-eval's command line, with ``attn_implementation="qattn"`` known.

Same arguments as ``lm_eval``, e.g.::

    python -m hf_qattn.evaluation.lm_eval --model hf \\
        --model_args pretrained=DIR,attn_implementation=qattn,dtype=float32 \\
        --include_path eval/lm_eval_tasks --tasks wikitext2_local

A wheel install of hf-qattn makes the plain ``lm_eval`` command accept ``attn_implementation=qattn``
too (the startup hook, ``_hf_qattn_startup``); this module is the way that needs no hook (editable
installs, environments that skip ``.pth`` files).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as error:
        raise SystemExit(f"hf_qattn.evaluation.lm_eval needs lm-eval ({error}): pip install 'hf-qattn[eval]' "
                         "(or pip install lm-eval)") from None
    import hf_qattn  # noqa: F401  (registers "qattn" with transformers as its modules load)

    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
