"""Offline fits over replay results: the certificate's multiplier, the sketch's layers, statistics and evidence,
the adaptive gate's grid."""
