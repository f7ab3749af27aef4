"""dsv4 engine: DeepSeek-V4 inference with paged DSV4 memory and PD disaggregation."""
