"""Hugging Face exchange: checkpoint conversion (`convert`, the driver, with one adapter per model
family: `pmlm_adapter` and `palm_adapter`; what they share in `folder`), which family a path holds
(`family`), and the remote-code model files (`configuration_pmlm.py`, `modeling_pmlm.py`,
`configuration_palm.py`, `modeling_palm.py`) written into converted folders. See docs/conversion.md."""
