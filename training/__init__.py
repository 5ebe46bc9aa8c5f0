"""medusa_trt.training."""
