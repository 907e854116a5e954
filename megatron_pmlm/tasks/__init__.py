"""Downstream tasks on Hugging Face's Trainer: GLUE (`glue`), SQuAD (`squad`) and what they share
(`hf_trainer`); the commands are megatron_pmlm.finetune_glue / finetune_squad."""
