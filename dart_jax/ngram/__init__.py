"""N-gram model of DART: counting, the reference `.trie` format, device table.

  ngram = NGram.build(sequences, order=3)        # or NGram.load_trie(path)
  ngram = load_ngram()                           # the one shipped for SmolLM2
  table = ngram.to_table()                       # pytree for jitted search
  probs, matched = ngram.probability(ctx, toks)  # numpy reference query
  ContextNGram / ContextNGramConfig              # each sequence's own n-grams (search)
"""

from dart_jax.ngram.context import ContextNGram, ContextNGramConfig
from dart_jax.ngram.model import NGram, load_ngram
from dart_jax.ngram.table import NGramTable

__all__ = ["ContextNGram", "ContextNGramConfig", "NGram", "NGramTable", "load_ngram"]
