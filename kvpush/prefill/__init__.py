"""prefill"""
