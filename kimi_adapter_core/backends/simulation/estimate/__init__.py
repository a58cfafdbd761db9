"""What one step costs."""
