"""ResPipe: the pipeline made resilient (backups, replicas, deadlines, ULFM), and its cost model."""
