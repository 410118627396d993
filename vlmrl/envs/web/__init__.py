"""Environments that are real software in a real browser: MiniWoB++ tasks in a headless Chromium
(`vlmrl.envs.web.miniwob`), driven through the actions of `vlmrl.envs.web.actions` at points of the screenshot the
model saw (`vlmrl.envs.web.frame`), with one browser per concurrent episode (`vlmrl.envs.web.pool`)."""
