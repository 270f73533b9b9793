"""What users see of a study: status, progress, the dashboard, the note, the export."""
