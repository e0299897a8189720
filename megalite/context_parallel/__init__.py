"""Context parallelism: sequences split over the CP group, ring attention."""
