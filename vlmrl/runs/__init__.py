"""Run folders: their files and lock, JSONL records, checkpoints, resuming, progress lines and metric trackers."""
