"""vllm-tour: see what upstream vLLM does, step by step, at a pinned version.

The public read API for notebooks and scripts:

    import vllm_tour
    run = vllm_tour.load_run("latest")      # a run directory, or a name under traces/runs/ or traces/golden/
    rows = run.step_rows()                  # one dict per (step, rank): hand it to pandas or polars

Layers, bottom to top (a module imports only its own layer and those below; tests/test_layers.py holds the order):
errors, paths · trace/ (the record model) · scenario · upstream/ (pins, models, doctor) · probes/ ·
engine/ (running upstream with probes) · compare/, repro/ · notes/ · views/ · site/ · bench/, gpu/, lab/,
platforms/ · cli.
"""

from vllm_tour.paths import TOUR_VERSION as __version__

__all__ = ["load_run", "Run", "__version__"]


def __getattr__(name: str):
    # Lazy: the probes' plugin imports vllm_tour in every vLLM process, and the GPU machine has no
    # pydantic; the record reader is loaded only when a script asks for it.
    if name in ("load_run", "Run"):
        from vllm_tour.trace import reader
        return getattr(reader, name)
    raise AttributeError(f"module 'vllm_tour' has no attribute {name!r}")
