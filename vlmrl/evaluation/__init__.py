"""Evaluation: `vlmrl generate` (eval-only rollouts into a run folder), `trainer.eval_every`, and `vlmrl evaluate`
(the report of a run folder).

generate         `generate`, the loop of `vlmrl generate` (chunks of problems -> the run folder)
metrics          pass@k and the evaluation metrics of trajectory records
rollouts         eval-only rollouts: the eval split's data config, a runner around a plain module, full records
run_folder       the resumable run folder of `vlmrl generate` (`GenerateFiles`)
during_training  `eval_during_training`, the eval split run with the current policy during training
report/          `vlmrl evaluate RUN_DIR`: metric table, plots and the trajectory viewer of a run folder
"""
