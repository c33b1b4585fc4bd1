"""The source tree of a pin: installed, in its environment (`pin add`), cached, or fetched now (once) from its wheel."""

from __future__ import annotations

from typing import Callable

from vllm_tour.errors import TourError
from vllm_tour.notes.resolve import SourceTree
from vllm_tour.upstream import envs, pins

_TREES: dict[str, SourceTree] = {}


def tree_for_pin(tag: str | None = None, status: Callable[[str], None] | None = None) -> SourceTree:
    """A SourceTree for `tag` (default: the pin of the installed vLLM).

    A pin that is neither installed nor cached is fetched on demand: a fresh CI
    machine runs `annotations check --pin v0.21.0` without a manual step.
    """
    tag = tag or pins.active_pin_tag()
    if tag in _TREES:
        return _TREES[tag]
    pin = pins.load_pin(tag)  # unknown pin: TourError naming the known ones
    # a `pin add` environment holds the release as installed and run; a cached copy of its wheel may be older
    root = envs.env_sources(tag)
    if root is None:
        try:
            root = pins.pin_sources(tag)
        except TourError:
            root = None
    if root is None:
        dist = pin.distributions.get(pin.platform) or next(iter(pin.distributions.values()))
        if status:
            status(f"fetching sources of pin {tag} ({dist.dist}=={dist.version} wheel, once; cached afterwards)…")
        root = pins.fetch_sources(tag)
        digest, _ = pins.source_digest(root)
        if status and digest != pin.source_digest:
            # annotated on other code than the pin names: say so, but still show it
            status(f"warning: fetched sources of {tag} have digest {digest}, pin says {pin.source_digest}")
    _TREES[tag] = SourceTree(root, label=f"pin {tag}")
    return _TREES[tag]
