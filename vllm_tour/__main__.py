from vllm_tour.cli import main

main()
