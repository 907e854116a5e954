"""Hugging Face exchange: checkpoint conversion (`convert`, and `convert_palm` for PALM), the PMLM
model's adapter to and from Hugging Face's names and config (`pmlm_adapter`), and the remote-code
model files (`configuration_pmlm.py`, `modeling_pmlm.py`) written into every converted folder with
the relative position bias. See docs/conversion.md."""
