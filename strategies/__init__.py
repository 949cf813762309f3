"""Lightning strategies of lit3d."""
