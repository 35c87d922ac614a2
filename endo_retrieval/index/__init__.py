"""The stored index of a corpus: documents streamed into feature postings, saved and loaded (engine.py), the
inverted feature index, passages, segments, text files and the readers-writer lock. Searching it is the methods'
(methods/search.py)."""
