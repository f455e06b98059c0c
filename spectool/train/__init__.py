"""Training on a local corpus: the BPE tokenizer and small target (target.py), draft layers (draft.py).

``spectool train-target`` and ``spectool train-draft`` (cli.py) drive them; data.py holds the
standard-library corpus and its fixed held-out modules; docs/TRAINING.md has the recipe.
"""
