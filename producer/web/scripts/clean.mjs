// Remove build output given as arguments, so a renamed source never leaves a stale module behind.
import { rmSync } from "node:fs";

for (const dir of process.argv.slice(2)) rmSync(dir, { recursive: true, force: true });
