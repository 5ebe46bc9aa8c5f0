"""medusa_trt.cli."""
