"""endo-retrieval's benchmarks (`endo bench ...`): quality of one long context (`runner`, `bench`), corpus retrieval
(`corpus_bench`), speed and memory (`perf`, `perf_e2e`, `perf_scale`), decode-time attention (`attention_bench`,
`attention_error`), the signals alone (`signals`), reranking (`rerank`), metrics (`metrics`) and the outside
baselines and peers (`baselines`). The data readers are the library's
(`endo_retrieval.calibration.datasets`): calibration reads the same files."""
