"""The built-in DLRM recommender family (models/dlrm/): dense features through an MLP, categorical features through
embedding tables, their dot-product interaction through a second MLP to a click logit. Trained on the
recommendation task (tasks/recommendation.py) from `scaletrain data prepare --format tabular` folders; its tables are
sharded over the ranks row-wise or table-wise (parallel.embedding_sharding, parallel/embedding.py).

torchrec is not used: torchrec 1.9.2 needs torch 2.14 (with fbgemm-gpu-cpu 1.9.0), and the pinned torch is 2.13.0
(pyproject.toml); the tables are sharded with torch.distributed's all-gather and all-to-all and DTensor instead."""

from scaletrain.models.dlrm.args import PRESETS, DLRMArgs
from scaletrain.models.dlrm.spec import DLRMSpec

SPEC = DLRMSpec

__all__ = ["PRESETS", "SPEC", "DLRMArgs", "DLRMSpec"]
