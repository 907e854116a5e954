"""Hugging Face exchange: checkpoint conversion (`convert`) and the remote-code model files
(`configuration_pmlm.py`, `modeling_pmlm.py`) written into every converted folder with the
relative position bias. See docs/conversion.md."""
