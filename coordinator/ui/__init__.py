"""What a person sees and types: the ``fedge-coordinator`` command line and the live round table."""
