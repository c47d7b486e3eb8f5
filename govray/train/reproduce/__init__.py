"""What a re-run needs: the reproducibility record and the code and corpus snapshots it names."""
