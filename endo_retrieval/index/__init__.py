"""The index over a corpus and its storage: the inverted feature index, the S3 engine and the default pipeline
over it, the token <-> document map, segments, crash-safe files and the readers-writer lock."""
