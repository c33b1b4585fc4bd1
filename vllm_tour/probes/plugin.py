"""vLLM general-plugin entry point: installs probes in every vLLM process of a traced run."""

import os

RUN_DIR_ENV = "VLLM_TOUR_RUN_DIR"


def register() -> None:
    from vllm_tour.probes.cpu_isa import install_override

    install_override()  # only when a scenario forces the CPU attention ISA (traced or not)
    if not os.environ.get(RUN_DIR_ENV):
        return
    from vllm_tour.probes.install import install_all

    install_all()
