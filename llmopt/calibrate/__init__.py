"""Calibration: sample token windows from local or `datasets` sources (mixed, deduplicated, seeded,
checked against eval data), run the model layer by layer over them, and record activation statistics
(per-channel absmax / mean |x|, observer ranges, per-head K/V absmax) for quantization.
"""

from __future__ import annotations

from llmopt.calibrate.forward import CalibBatch, KVObserver, embed_batches, layer_copy, run_layer
from llmopt.calibrate.manifest import MANIFEST, STATS, Manifest, ModelIdentity
from llmopt.calibrate.run import CalibrateConfig, CalibrationDataConfig, run_calibration, sample_windows
from llmopt.calibrate.sources import DataSource, load_texts
from llmopt.calibrate.stats import CalibrationStats, SavedStats, collect_stats
from llmopt.calibrate.windows import CalibrationSet, build_calibration_set

__all__ = [
    "MANIFEST",
    "STATS",
    "CalibBatch",
    "CalibrateConfig",
    "CalibrationDataConfig",
    "CalibrationSet",
    "CalibrationStats",
    "DataSource",
    "KVObserver",
    "Manifest",
    "ModelIdentity",
    "SavedStats",
    "build_calibration_set",
    "collect_stats",
    "embed_batches",
    "layer_copy",
    "load_texts",
    "run_calibration",
    "run_layer",
    "sample_windows",
]
