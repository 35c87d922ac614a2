"""Past one machine, on Ray: index segments built by workers, an index opened as shards, ILRe's chunks over GPUs.

Ray (`pip install endo-retrieval[ray]`) starts and places the processes and moves the bytes; this package only says
what each process does (a module each: `cluster`, `indexing`, `shards`, `first_stage`, `ilre`). Call `ray.init()`
first: with no address it starts a local cluster; `ray start --head` on one node and `ray start --address=HEAD:6379`
on the others make a cluster that `ray.init(address="auto")` joins.

* `RayIndexer`: one `ModelWorker` per accelerator (or per CPU slot where there is none) loads the backbone and
  SAEs once and indexes a contiguous share of the documents into a segment of the usual format, sent back as
  bytes; the driver writes the segments and commits them with a manifest written last (`segments.py`).
* `ShardedIndex`: a committed index opened as shards held by actors (plain actors: a query is one fan-out and one
  merge, which needs no HTTP layer; Ray Serve can wrap `ShardedIndex.search` as a deployment unchanged). A
  question is encoded once by the driver; every shard scores it with the whole index's statistics ([S3 Eq. 10]'s
  feature frequencies, BM25's idf and mean length) and streams its density peaks; the driver merges the streams by
  (density, position) and fills the budget as one index does, so spans and ranking equal the union's.
* `ilre_scores`: the chunks of one long context spread over workers (each chunk needs only its sink and window
  frame); [ILRe Eq. 5]'s softmax over the whole context is merged with a per-part logsumexp, then [ILRe Alg. 1]
  allocates.
* the default pipeline `endo` over shards and readers: `distributed_pipeline.py` (`ReaderPool`), whose stage 1
  runs on these shards (`first_stage.py`): BM25 with the whole index's statistics and, where the workers embedded
  the passages (an `endo` index does by default), the dense ranking, fused as one process fuses them (hybrid).
"""
from endo_retrieval.distributed.cluster import (BuildError, ModelRecipe, ModelWorker, connect, ray_cluster, spread,
                                                start_workers)
from endo_retrieval.distributed.indexing import RayIndexer, shares
from endo_retrieval.distributed.shards import Shard, ShardedIndex, shares_of
from endo_retrieval.distributed.ilre import ilre_scores, ilre_select

__all__ = ["BuildError", "ModelRecipe", "ModelWorker", "RayIndexer", "Shard", "ShardedIndex", "connect",
           "ilre_scores", "ilre_select", "ray_cluster", "shares", "shares_of", "spread", "start_workers"]
