"""`tokenfab plan`: parallel layouts and memory per device from a model config and a hardware description."""
