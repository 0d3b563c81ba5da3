"""The ground floor: errors, files, progress, configuration, devices."""
