"""Labs: write one component of the mini engine yourself and diff it against upstream vLLM.

`vllm-tour lab new COMPONENT DIR` writes a skeleton generated from the reference in
`reimpl/` (catalog.py says which file, what is left to write, which notes to read);
`vllm-tour lab check DIR` runs `compare` with the learner's file swapped in.
"""
