"""medusa_trt.plugins."""
