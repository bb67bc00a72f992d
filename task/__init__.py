"""The RLVR task: the problems, what the model is asked, the format it answers in, its grading
and the reward. problems.py loads training problems and benchmarks and holds the prompt and the
answer format (sections 1-3); grading.py reads the answer back, grades it with Math-Verify and
gives the reward (sections 4-5), and runs that grading in worker processes with a hard per-item
timeout (section 6). It imports no chapter: the chapters and machinery/cli.py use it.
"""
