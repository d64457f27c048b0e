"""stk-scan: distributed, header-only, incremental discovery of an image dataset."""

from stk.scan.pipeline import ScanOptions, ScanSummary, run_scan

__all__ = ["ScanOptions", "ScanSummary", "run_scan"]
