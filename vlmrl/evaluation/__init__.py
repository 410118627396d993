"""The pieces of `vlmrl generate` and of `trainer.eval_every`:

generate         `generate`, the loop of `vlmrl generate` (chunks of problems -> the run folder)
metrics          pass@k and the evaluation metrics of trajectory records
rollouts         eval-only rollouts: the eval split's data config, a runner around a plain module, full records
run_folder       the resumable run folder of `vlmrl generate` (`GenerateFiles`)
during_training  `eval_during_training`, the eval split run with the current policy during training
"""
