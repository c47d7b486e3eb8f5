"""The digits example: scikit-learn's bundled 8x8 handwritten digits as three credentialed corpora."""
