"""Building pretraining corpora for make_corpus.py."""
