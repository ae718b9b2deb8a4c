"""Low-precision checkpoint formats: detect quant_method, hold packed weights, hand them to the kernels."""
