"""The pure-Python N-gram corpus reference (the trie's test oracle) lives in spectool.trace,
where the checker uses it too."""

from spectool.trace.ngram_reference import Node, ReferenceCorpus  # noqa: F401
