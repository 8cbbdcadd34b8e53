"""Documents for the local perplexity tasks, read from a plain-text file (no hub, no conversion step).

Used by ``wikitext2_local.yaml`` through lm-eval's ``custom_dataset``. Options go in ``--metadata``
(a JSON object), e.g. ``--metadata '{"text_file": "/path/to/corpus.txt", "docs": 3}'``:

- ``text_file``: the text; default ``$HF_QATTN_WIKITEXT2/test.txt`` or else WikiText-2 test from the
  project's shared data (``../shared/data/wikitext2/test.txt`` beside the repository);
- ``split``: how the text becomes documents: ``wikitext`` (an article starts at a `` = Title = `` line
  between blank lines, as in WikiText's document-level form; the default), ``paragraph`` (blank lines),
  ``file`` (one document);
- ``docs``: 0 = every document (lm-eval's definition); N > 0 = the N shortest documents, in file order
  (a token budget for slow runs, e.g. the CPU reference path); ``"i,j,k"`` = those indices.

The metrics are lm-eval's own wikitext definitions (its detokenizer and ``process_results``): word and
byte perplexity = exp(-Σ loglikelihood / Σ count), bits per byte = -Σ loglikelihood / Σ bytes / ln 2,
with words and bytes counted on the original (tokenized-form) text.
"""

from __future__ import annotations

import os
import re

from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
_ARTICLE = re.compile(r"^ = [^=].* = $")


def default_text_file() -> str:
    root = os.environ.get("HF_QATTN_WIKITEXT2") or os.path.join(HERE, "..", "..", "..", "shared", "data", "wikitext2")
    return os.path.normpath(os.path.join(root, "test.txt"))


def split_documents(text: str, split: str = "wikitext") -> list[str]:
    if split == "file":
        return [text]
    if split == "paragraph":
        return [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    if split != "wikitext":
        raise ValueError(f"split must be 'wikitext', 'paragraph' or 'file'; got {split!r}")
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines)
              if _ARTICLE.match(line) and (i == 0 or not lines[i - 1].strip())
              and (i + 1 == len(lines) or not lines[i + 1].strip())]
    if not starts:
        return [text] if text.strip() else []
    bounds = [0] + starts[1:] + [len(lines)]  # text before the first title belongs to the first document
    return [d for d in ("\n".join(lines[a:b]) for a, b in zip(bounds, bounds[1:])) if d.strip()]


def select(documents: list[str], docs=0) -> list[str]:
    if isinstance(docs, str) and "," in docs or isinstance(docs, (list, tuple)):
        indices = [int(i) for i in (docs.split(",") if isinstance(docs, str) else docs)]
        return [documents[i] for i in indices]
    docs = int(docs or 0)
    if docs <= 0 or docs >= len(documents):
        return documents
    shortest = sorted(range(len(documents)), key=lambda i: (len(documents[i]), i))[:docs]
    return [documents[i] for i in sorted(shortest)]


def load_documents(text_file: str | None = None, split: str = "wikitext", docs=0) -> list[str]:
    path = text_file or default_text_file()
    if not os.path.isfile(path):
        where = ("the metadata's text_file" if text_file else
                 "the default, WikiText-2 test from $HF_QATTN_WIKITEXT2" if os.environ.get("HF_QATTN_WIKITEXT2") else
                 "the default, WikiText-2 test from the shared data beside the repository")
        raise FileNotFoundError(f"no text file at {path} ({where}); point the task at a plain-text file with "
                                "--metadata '{\"text_file\": \"FILE\"}'")
    with open(path, encoding="utf-8") as f:
        return select(split_documents(f.read(), split), docs)


def load(text_file: str | None = None, split: str = "wikitext", docs=0, **_ignored):
    """lm-eval ``custom_dataset``: a DatasetDict with one ``test`` split of ``{"page": document}`` rows."""
    import datasets

    pages = load_documents(text_file, split, docs)
    return datasets.DatasetDict({"test": datasets.Dataset.from_dict({"page": pages})})
