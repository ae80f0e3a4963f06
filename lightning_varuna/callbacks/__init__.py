"""Lightning callbacks of lightning-varuna."""
