// The demo's static files next to its compiled module: dist/demo/ is then the whole page.
import { cpSync } from "node:fs";

cpSync("demo", "dist/demo", { recursive: true, filter: (path) => !path.endsWith(".ts") });
