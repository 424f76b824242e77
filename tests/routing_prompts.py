"""Prompts clearly different in kind (code snippets vs. children's stories) for routing tests on stories260K."""

CODE = [
    "def add(a, b):\n    return a + b",
    "for (int i = 0; i < n; i++) { sum += a[i]; }",
    "import numpy as np\nx = np.zeros((3, 4))",
    "SELECT name, COUNT(*) FROM users GROUP BY name;",
    "if (x != NULL) { free(x); x = NULL; }",
    "const f = (xs) => xs.map(x => x * 2).filter(Boolean);",
    "class Stack:\n    def __init__(self):\n        self.items = []",
    "fn main() { let v: Vec<i32> = vec![1, 2, 3]; println!(\"{:?}\", v); }",
    "while read -r line; do echo \"$line\" | cut -d, -f2; done < data.csv",
    "x = [i ** 2 for i in range(10) if i % 2 == 0]",
    "public static void main(String[] args) { System.out.println(args.length); }",
    "#include <stdio.h>\nint main(void) { return 0; }",
]
STORY = [
    "Once upon a time, there was a little girl named Lily. She loved to play in the park.",
    "Tom and his dog went to the beach. They saw a big red boat on the water.",
    "The sun was shining and the birds were singing. Mia wanted to pick some flowers for her mom.",
    "One day, a little bunny found a shiny stone under a tree. He was very happy.",
    "Sara had a new toy car. She showed it to her friend Ben and they played all day.",
    "The old cat sat by the window. It looked at the rain and felt sleepy.",
    "Max wanted to fly like a bird. He jumped and jumped, but he could not fly.",
    "Anna baked a cake with her grandma. It was sweet and yummy.",
    "A big bear lived in the forest. He liked to eat honey and sleep in the sun.",
    "Lucy lost her ball in the garden. Her brother helped her find it behind a bush.",
    "The little fish swam fast to find his mom. She was waiting near the big rock.",
    "Tim was sad because it was raining. Then his mom gave him a warm hug.",
]
