"""Whether getting a model (a hub download, a registry model's conversion) shows progress bars: a run asked to be
quiet (-q, --json, the Python API's default) shows none, neither batchrun's nor those of the libraries it calls.
No torch or transformers at import.
"""
from __future__ import annotations

import contextlib
import functools
from contextvars import ContextVar
from typing import Iterator

_shown: ContextVar[bool] = ContextVar("batchrun_model_progress_bars", default=True)


@contextlib.contextmanager
def progress_bars(shown: bool) -> Iterator[None]:
    """Inside, a model provisioned or downloaded shows its progress bars only where `shown`."""
    token = _shown.set(shown)
    try:
        yield
    finally:
        _shown.reset(token)


def bars_shown() -> bool:
    return _shown.get()


@contextlib.contextmanager
def hub_bars() -> Iterator[None]:
    """huggingface_hub's download bars, hidden inside unless bars are shown (its switch is global: restored after)."""
    if bars_shown():
        yield
        return
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()


@contextlib.contextmanager
def conversion_bars() -> Iterator[None]:
    """The bars of a GGUF conversion, hidden inside unless bars are shown: transformers' own (loading, saving) and
    the GGUF reader's, which uses tqdm directly. Imports transformers: for the conversion only."""
    if bars_shown():
        yield
        return
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_loading
        from transformers.utils import logging as transformers_logging
    except ImportError:  # the conversion says what it needs itself
        yield
        return
    was_enabled = transformers_logging.is_progress_bar_enabled()
    plain_tqdm = gguf_loading.tqdm
    transformers_logging.disable_progress_bar()
    gguf_loading.tqdm = functools.partial(plain_tqdm, disable=True)
    try:
        with hub_bars():
            yield
    finally:
        gguf_loading.tqdm = plain_tqdm
        if was_enabled:
            transformers_logging.enable_progress_bar()
