"""A vision-language model's image interface."""
