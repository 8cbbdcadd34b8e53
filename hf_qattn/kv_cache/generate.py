"""``model.generate`` with its decode steps replayed from CUDA graphs: transformers' own call, no user loop.

    cache = hf_qattn.QAttnCache(model)
    ids = model.generate(ids, cache=cache, max_new_tokens=256, custom_generate=hf_qattn.captured_generate)

transformers runs its preparation (generation config, logits processors, stopping criteria) and hands
the decoding to :func:`captured_generate` (its documented ``custom_generate`` hook, called like its own
``_sample``). That function sizes the cache's storage once for the prompt plus ``max_new_tokens``
(static storage: no reallocation, a device-side token count), runs the prefill eagerly, and each later
token through one :class:`~hf_qattn.CapturedDecodeStep` (one CUDA graph replay per token; on a CPU the
same step runs eagerly). Greedy search and sampling use the processors transformers prepared, so the
tokens are those of transformers' loop over the same cache.

Why not transformers' compiled generation: its CUDA graphs come from ``torch.compile`` of the whole
forward with the cache's Python state as guards; a QAttnLayer's host-side token count changes every
step, so every step would recompile (or the layer would have to give up the host count that the
eager path and ``get_seq_length`` rely on). The graph here is captured once, around a step whose
only changing inputs live in device memory.

What it does not replay (left padding: rows at different positions; requests for scores, logits,
attentions or hidden states; a cache that is not a QAttnCache or was filled before; ``synced_gpus``, whose
ranks must all step until the last has finished): it warns once
and runs transformers' own sampling loop on the same cache (eager qattn), counted in
:func:`hf_qattn.fallback_stats` as ``captured_generate: <reason>``.

It replays greedy search and sampling only. transformers hands a ``custom_generate`` function every call
whatever its generation mode (beams expanded into the batch): beam search and prompt-lookup decoding go on to
transformers' own method for them, counted likewise; a mode transformers keeps in a Hub repository
(contrastive search, DoLa, group or constrained beam search) is a ``ValueError`` — never greedy tokens in its
place.

transformers' generate (5.17–5.24) hands a callable ``custom_generate`` neither its ``streamer`` nor its
``synced_gpus``: a streamer given to ``generate`` receives the prompt and nothing after it (stream from a loop
around :class:`~hf_qattn.CapturedDecodeStep` instead); DeepSpeed ZeRO-3 / FSDP is detected here as generate
detects it.
"""

from __future__ import annotations

import inspect

import torch

from ..stats import record_degraded
from .attention import QAttnCacheError
from .captured import CapturedDecodeStep, cache_argument

_OUTPUT_REQUESTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def _why_not_replayed(model, input_ids, cache, generation_config, model_kwargs, synced_gpus: bool) -> str | None:
    from .cache import QAttnCache

    if synced_gpus:  # this loop stops when its own rows finish; the other ranks would wait on its forwards
        return "synced_gpus (DeepSpeed ZeRO-3 / FSDP: every rank steps until all have finished)"

    if not isinstance(cache, QAttnCache):
        return f"the cache is a {type(cache).__name__}, not an hf_qattn.QAttnCache"
    if cache.get_seq_length() != 0:
        return "the cache already holds tokens"
    if model.config.is_encoder_decoder:
        return "an encoder-decoder model"
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        return "a padded batch (rows at different positions)"
    if generation_config.return_dict_in_generate and any(getattr(generation_config, name, False)
                                                         for name in _OUTPUT_REQUESTS):
        return "scores, logits, attentions or hidden states were requested"
    return None


def _synced_gpus(model, synced_gpus: bool) -> bool:
    """Whether every rank must run forwards until all have finished: ``synced_gpus``, or as transformers' generate
    decides it (DeepSpeed ZeRO-3 or FSDP over more than one process), since generate hands a callable
    ``custom_generate`` neither its ``synced_gpus`` nor its ``streamer`` (transformers 5.17–5.24: only the
    function's own extra arguments)."""
    if synced_gpus:
        return True
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1):
        return False
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    try:
        from transformers.distributed.fsdp import is_fsdp_managed_module
    except ImportError:  # another transformers layout: ZeRO-3 alone is checked
        return is_deepspeed_zero3_enabled()
    return is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)


def _transformers_method(generation_config):
    """transformers' own decoding method for the call's generation mode when it is neither greedy search nor
    sampling: (its name, the mode), or None for the two modes replayed here. A mode whose method transformers
    keeps in a Hub repository raises (the repository's own ``custom_generate`` would replace this one)."""
    from transformers.generation.configuration_utils import GenerationMode
    from transformers.generation.utils import GENERATION_MODES_MAPPING

    mode = generation_config.get_generation_mode()
    if mode in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return None
    method = GENERATION_MODES_MAPPING.get(mode)
    if method is None or "/" in method:
        raise ValueError(f"custom_generate=hf_qattn.captured_generate runs greedy search and sampling (beam search "
                         f"and prompt lookup through transformers' own methods); this generation config asks for "
                         f"{mode.value.replace('_', ' ')}, which transformers runs from "
                         f"{'the Hub repository ' + repr(method) if method else 'no method of its own'}")
    return method, mode.value.replace("_", " ")


def captured_generate(model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
                      synced_gpus: bool = False, streamer=None, **model_kwargs):
    """transformers' ``custom_generate`` entry: greedy search or sampling with each decode step replayed
    from a CUDA graph over the QAttnCache passed as ``cache=`` (``past_key_values=`` before transformers
    5.24). Returns what ``generate`` returns: the sequences, or a ``GenerateDecoderOnlyOutput`` holding
    them (and the cache) when ``return_dict_in_generate``. Other generation modes: see the module's doc."""
    synced_gpus = _synced_gpus(model, synced_gpus)
    other = _transformers_method(generation_config)
    if other is not None:  # beams, prompt lookup: transformers' own loop over the same cache, counted
        method, mode = other
        run = getattr(type(model), method)
        if streamer is not None:
            if "streamer" not in inspect.signature(run).parameters:
                raise ValueError(f"streamer cannot be used with {mode} (transformers' generate refuses it too)")
            model_kwargs["streamer"] = streamer
        record_degraded(f"captured_generate: {mode} is not greedy search or sampling", f"eager (transformers' {mode})")
        return run(model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                   generation_config=generation_config, synced_gpus=synced_gpus, **model_kwargs)
    keyword = cache_argument(model)
    cache = model_kwargs.get(keyword)
    reason = _why_not_replayed(model, input_ids, cache, generation_config, model_kwargs, synced_gpus)
    if reason is None:
        try:
            cache.reserve(input_ids.shape[1] + _new_tokens(input_ids, generation_config))
        except QAttnCacheError as error:
            reason = str(error)
    if reason is not None:  # counted, and warned once per reason
        record_degraded(f"captured_generate: {reason}", "eager (transformers' decoding loop)")
        return type(model)._sample(model, input_ids, logits_processor=logits_processor,
                                   stopping_criteria=stopping_criteria, generation_config=generation_config,
                                   synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)

    pad = generation_config._pad_token_tensor
    has_eos = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    prefill = {keyword: cache}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        prefill["logits_to_keep"] = 1  # the prompt's last position only (a 16k prompt's logits are gigabytes)
    with torch.no_grad():
        logits = model(input_ids, use_cache=True, **prefill).logits[:, -1]
        step = CapturedDecodeStep(model, cache) if input_ids.device.type == "cuda" else _EagerStep(model, cache)
        while True:
            scores = logits_processor(input_ids, logits.to(dtype=torch.float32, copy=True))
            if generation_config.do_sample:
                tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                tokens = scores.argmax(dim=-1)
            if has_eos:
                tokens = tokens * unfinished + pad * (1 - unfinished)
            input_ids = torch.cat([input_ids, tokens[:, None]], dim=-1)
            if streamer is not None:
                streamer.put(tokens.cpu())
            step._load(tokens[:, None])  # before the stop test's wait: after it only the replay is launched
            unfinished = unfinished & ~stopping_criteria(input_ids, scores)
            if not bool(unfinished.any()):
                break
            logits = step._run()[:, -1]
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=input_ids, **{keyword: cache})
    return input_ids


def _new_tokens(input_ids, generation_config) -> int:
    """The most tokens the stopping criteria let ``generate`` add (max_new_tokens, else max_length)."""
    if generation_config.max_new_tokens is not None:
        return generation_config.max_new_tokens
    return max(0, generation_config.max_length - input_ids.shape[1])


class _EagerStep:
    """The captured step's call on a device without CUDA graphs: one eager forward per token."""

    def __init__(self, model, cache):
        self.model, self.kwargs = model, {cache_argument(model): cache}

    def _load(self, tokens):
        self.tokens = tokens

    def _run(self):
        return self.model(self.tokens, use_cache=True, **self.kwargs).logits
